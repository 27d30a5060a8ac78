"""`python -m pyengine serve|generate ...` (the `pyengine` console script): the subcommands."""
from __future__ import annotations

import sys

USAGE = "usage: pyengine {serve,generate} [args...]  (pyengine <command> --help for its flags)"


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from pyengine.entrypoints.openai.api_server import main as serve

        return serve(rest)
    if command == "generate":
        from pyengine.entrypoints.generate import main as generate

        return generate(rest)
    print(f"error: unknown command {command!r}; {USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
