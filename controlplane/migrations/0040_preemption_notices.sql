-- A preemption's notice, one row per victim and preemptor: the cut (the notice's end, where the
-- victim's bookings now end) and the end the victim had before it. A preemptor that goes away
-- before the cut gives the victim that end back (controlplane/reservations/preemption.py). The
-- preemptor is recorded even when it is another tenant's, whose id the victim is never shown.
CREATE TABLE preemption_notices (
    victim_id    text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    preemptor_id text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    cut          timestamptz NOT NULL,
    until        timestamptz NOT NULL,
    PRIMARY KEY (preemptor_id, victim_id)
);
CREATE INDEX preemption_notices_victim ON preemption_notices (victim_id);
