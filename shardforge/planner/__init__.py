"""The layout planner: a memory and time model of a run on some hardware, a search over layouts, and the
preflight that checks a layout before any process starts (docs/planner.md)."""
