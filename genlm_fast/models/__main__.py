"""``python -m genlm_fast.models [llama3.2-1b | llama3.1-8b] [--dtype D] [--seed S]``: build
(once) a seeded Llama-3-architecture checkpoint and print its directory."""

from genlm_fast.models.llama3 import main

raise SystemExit(main())
