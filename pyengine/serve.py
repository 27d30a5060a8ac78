"""`python -m pyengine.serve`: the server lives in pyengine.entrypoints.openai.api_server."""
from pyengine.entrypoints.openai.api_server import main

if __name__ == "__main__":
    raise SystemExit(main())
