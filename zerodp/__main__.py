import sys

from zerodp.cli import main

sys.exit(main())
