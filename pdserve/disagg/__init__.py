"""Prefill/decode disaggregation on top of the engine.

Engine process: `export_side.PrefillExporter` (push a computed prompt's KV to a decode instance) and
`import_side.DecodeImporter` (describe reserved blocks, report validated arrivals) — the two KV connectors the
engine creates by role (pdserve.engine.kv_connector) and only asks questions of. Server process: `driver.DecodeDriver`
(the decode instance's orders to prefill instances) and `routes` (the internal HTTP routes of each role).
"""
