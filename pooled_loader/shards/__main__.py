"""``python -m pooled_loader.shards``."""
from . import main

raise SystemExit(main())
