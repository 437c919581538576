"""``python -m pooled_loader.tune``."""
import sys

from . import main

sys.exit(main())
