from strata.cli import main

raise SystemExit(main())
