"""`python -m paratwin VERB ...`: the same as the `paratwin` console script."""

from paratwin.main import main

main()
