"""The advisor's arithmetic: memory, step time, layouts, prices and model presets.

No Django and no app: testable without a database, and below the marketplace, whose offers'
`fits=` filter uses it."""
