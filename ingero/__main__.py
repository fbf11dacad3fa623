from ingero.cli.main import main

raise SystemExit(main())
