-- Gangs: one reservation with an allocation per member node (spec "Gang reservations").
--
-- gang_group is the value of the gang's topologyKey label its members were placed under ('' for a
-- gang without a key; NULL for a reservation that is not a gang): BookingRepair replaces a member
-- inside that value, and the property tests check every member shares it.
ALTER TABLE allocations ADD COLUMN gang_group text;

-- A reservation never holds two live allocations on one node: a gang's members are distinct
-- nodes, and a single reservation has one allocation at a time.
CREATE UNIQUE INDEX allocations_one_live_per_node ON allocations (reservation_id, node_id)
    WHERE state IN ('placed', 'binding', 'bound');
