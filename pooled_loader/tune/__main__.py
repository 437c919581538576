"""``python -m pooled_loader.tune``, under the commands' one error rule (``_cli``)."""
import sys

from .._cli import run
from . import main

sys.exit(run(main, sys.argv[1:]))
