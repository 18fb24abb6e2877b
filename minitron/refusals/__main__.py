from .readme import main

raise SystemExit(main())
