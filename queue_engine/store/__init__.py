"""Delta I/O and what the tables need beside it, by concern, each a package whose ``__init__``
names what it offers:

- ``storage``: local and object-store paths, objects, put-if-absent, durable local files;
- ``delta``: Delta commit mechanics (open, log, features, appends, spare and removed files,
  power-cut tails);
- ``tables``: deltaq's tables, where each lives, its schema, its reader and writer;
- ``journal``: the node journal, acknowledged before the topic tables are;
- ``coordination``: nodes sharing a warehouse, lane ownership, locks in the warehouse;
- ``upkeep``: compaction, checkpoints, vacuum and retention.

Each builds only on packages listed before it: ``journal``, ``coordination`` and ``delta`` on
``storage`` alone, ``tables`` on ``storage``, ``delta`` and ``journal``'s records, ``upkeep`` on
``storage``, ``delta`` and ``tables`` (tests/test_layout.py holds them to it).
``delta``, ``tables`` and ``upkeep`` are the only packages of deltaq that import deltalake;
code outside ``store`` imports these packages, not their files.
"""
