-- A GPU's MIG instances and slots, found by their parent (hostile review, 2026-12-05): atoms.parent_id
-- references atoms(id) with no index, so deleting a node's gone parts (DELETE_UNUSED_PARTS: the
-- foreign key's check of each deleted row) and gone GPUs (DELETE_UNUSED_GPUS: "no part left") each
-- scanned every atom once per row. A time-slice node of 256 GPUs at 64 replicas reporting fresh
-- uuids (a 7 KB inventory) held its pool's lock for 18 seconds, every placement of the pool waiting.
CREATE INDEX atoms_parent ON atoms (parent_id) WHERE parent_id IS NOT NULL;
