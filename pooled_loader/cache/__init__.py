from .build import *  # noqa: F401,F403  (split into modules in the next commit)
from .build import __all__, main  # noqa: F401
