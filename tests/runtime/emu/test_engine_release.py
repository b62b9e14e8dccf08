"""A slot that dies while a primitive releases its sources: the engine's view of its units must
stay right (a source freed on the surviving slots is not a unit any more) and the failure is
reported."""

import pytest

from runtime.emu import slot_ops
from runtime.emu.engine import SourceReleaseError, UnitEngine
from runtime.emu.layout import UnitLayout
from runtime.emu.primitives import Destroy, Merge, Unit
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.slots import SlotError, SlotPool
from runtime.planner.catalog import default_catalog

pytestmark = pytest.mark.ray

MODEL = default_catalog().model("tiny-llama")


def _held(ctx) -> list[str]:
    return sorted(slot_ops._units(ctx))


def _unit(uid: str, slots: tuple[int, ...], tp: int = 1) -> Unit:
    layout = UnitLayout(model=MODEL, tp=tp, pp=1, training=True)
    return Unit(unit_id=uid, model_stage="actor@training", layout=layout, slots=slots)


def _dying_on_release(pool: SlotPool, slot: int, *, n_ids: int):
    """Wrap ``pool.run`` so that ``slot`` dies just as a release of ``n_ids`` units starts."""
    real = pool.run

    def run(fn, *args, **kwargs):
        if fn is slot_ops.release and len(kwargs.get("unit_ids", [])) == n_ids and not run.fired:
            run.fired = True
            pool.kill(slot)
        return real(fn, *args, **kwargs)

    run.fired = False
    return run, real


def test_a_slot_dying_during_a_release_leaves_no_released_unit_registered():
    with ray_connection(None, num_cpus=3):
        pool = SlotPool.create(3, call_timeout_s=20)
        try:
            engine = UnitEngine(pool)
            a = engine.create(_unit("a", (0,)), seed=3)
            b = engine.create(_unit("b", (1,)), seed=3)
            engine.create(_unit("keep", (2,)), seed=5)
            pool.run, real = _dying_on_release(pool, 1, n_ids=2)
            with pytest.raises(SlotError) as caught:
                engine.merge(Merge(units=(a, b), axis="tp", unit_id="m"))
            assert isinstance(caught.value, SourceReleaseError)
            # The merged unit was verified before the release: it is registered; the sources,
            # released on slot 0 and gone with slot 1, are not units any more.
            assert set(engine.units) == {"m", "keep"}
            assert set(engine.verified) == {"m", "keep"}
            assert real(_held, on=[0]) == [["m"]]
            # A unit destroyed while one of its slots is dead (not known lost yet) goes too.
            merged = engine.units["m"]
            with pytest.raises(SourceReleaseError):
                engine.destroy(Destroy(unit=merged))
            assert set(engine.units) == {"keep"}
            assert real(_held, on=[0]) == [[]]
            assert real(_held, on=[2]) == [["keep"]]
        finally:
            pool.close()
