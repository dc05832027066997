"""`python -m worker.data convert ...` (worker/data/convert.py)."""

import sys

from worker.data.convert import main

sys.exit(main())
