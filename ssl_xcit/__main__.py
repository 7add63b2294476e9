"""``python -m ssl_xcit fit -c recipes/quickstart.yaml`` is the same CLI as ``ssl-xcit``."""

from ssl_xcit.cli import console_main

if __name__ == "__main__":
    console_main()
