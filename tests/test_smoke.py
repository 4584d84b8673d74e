from tests.support import World


def test_create_places_four_nvlink_gpus(world: World) -> None:
    r = world.create(count=4, topology="nvlink-all", duration="8h")
    assert r.state == "placed", r
    assert len(r.allocations) == 1 and len(r.allocations[0].device_ids) == 4
