import sys

from fdam_ray.cli import main

sys.exit(main())
