from tokenbudget.cli import main

raise SystemExit(main())
