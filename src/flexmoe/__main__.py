"""``python -m flexmoe`` is the ``flexmoe`` command (what ``torchrun -m flexmoe`` runs)."""

from flexmoe.apps.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
