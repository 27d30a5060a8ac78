"""`python -m pyengine.generate`: the CLI lives in pyengine.entrypoints.generate."""
from pyengine.entrypoints.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
