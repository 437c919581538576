"""``python -m pooled_loader.cache ...``: the same as ``python -m pooled_loader cache ...``."""
import sys

from .._cli import run
from . import main

sys.exit(run(main, sys.argv[1:]))
