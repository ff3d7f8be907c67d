"""``python -m sclayout``: the same command line as the ``sclayout`` console script."""

from sclayout.cli import main

if __name__ == "__main__":
    main(prog_name="sclayout")
