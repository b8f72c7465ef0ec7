"""``python -m interlens``: the same command as the ``interlens`` console script (see ``_cli``)."""

from .cli import main

if __name__ == "__main__":
    main()
