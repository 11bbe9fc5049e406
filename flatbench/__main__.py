"""`python -m flatbench` is the same as the `flatbench` console script."""

from flatbench.cli import main

if __name__ == "__main__":
    main()
