"""The fleet's history in ClickHouse: the schema (:mod:`.schema`), the HTTP client (:mod:`.client`), the
shipper that copies a recording's new rows with resumable per-table progress (:mod:`.shipper`), the
read-only query path (:mod:`.query`) and the loaders that give the explain engine and the collectives
join a window of stored rows (:mod:`.history`)."""
