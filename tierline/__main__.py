"""``python -m tierline``: the same command line as the installed ``tierline`` script."""

from tierline.cli import main

main()
