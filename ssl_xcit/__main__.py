"""``python -m ssl_xcit fit -c recipes/quickstart.yaml`` is the same CLI as ``ssl-xcit``."""

from ssl_xcit.cli import main

if __name__ == "__main__":
    main()
