import sys

from rlhforge.cli.main import main

sys.exit(main())
