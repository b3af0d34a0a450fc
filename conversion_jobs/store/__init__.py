"""The database in one room (docs/ARCHITECTURE.md, "The store"): every SQL statement of the
product, one named constant or function per operation, its SQLite / ORM twin beside it, and the
one test of which database this is (``db.postgres``). The services call these by name and keep
the logic (which edge, which hook); this package imports the models and nothing above them."""
