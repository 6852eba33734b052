"""``python -m service.cli ROLE`` (how ``lastevent up`` and the tests start processes)."""

from service.cli import main

main()
