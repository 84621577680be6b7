import sys

from splash.cli import main

sys.exit(main())
