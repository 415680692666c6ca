from swaserve.cli import main

raise SystemExit(main())
