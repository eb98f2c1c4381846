"""A vLLM engine takes a broadcast version the way it measured faster (hpcrl/rollout/load_paths.py)."""
import logging

from hpcrl.rollout.load_paths import FOLDER, MAPPED, PROBE_EVERY, LoadPaths


def loads(paths: LoadPaths, seconds: dict, count: int, can_map=True, has_folder=True) -> list[str]:
    ways = []
    for _ in range(count):
        way = paths.pick(can_map, has_folder)
        paths.record(way, seconds[way])
        ways.append(way)
    return ways


def test_both_ways_are_tried_then_the_faster_is_kept_and_the_other_probed_now_and_then(caplog):
    paths = LoadPaths()
    with caplog.at_level(logging.INFO, logger="hpcrl.rollout.load_paths"):
        ways = loads(paths, {MAPPED: 0.315, FOLDER: 0.216}, 2 * PROBE_EVERY)
    assert ways[:2] == [MAPPED, FOLDER], "each way is tried once, the mapped one first"
    assert ways.count(MAPPED) == 1 + 2 and set(ways[2:PROBE_EVERY - 1]) == {FOLDER}
    assert ways[PROBE_EVERY - 1] == MAPPED, "the slower way is tried again every PROBE_EVERY loads"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["vLLM weight loads: shared memory 315 ms, folder 216 ms (medians of the last 3): loading "
                    "versions from their folders"], "the choice is said once, not at every load"


def test_a_change_in_speed_turns_the_choice_and_is_said():
    paths = LoadPaths()
    loads(paths, {MAPPED: 0.3, FOLDER: 0.2}, PROBE_EVERY)
    assert paths.chosen == FOLDER
    loads(paths, {MAPPED: 0.05, FOLDER: 0.2}, 3 * PROBE_EVERY)  # the probes see the mapped way got faster
    assert paths.chosen == MAPPED and paths.pick(True, True) == MAPPED


def test_a_version_that_offers_one_way_takes_it():
    paths = LoadPaths()
    assert loads(paths, {MAPPED: 0.1, FOLDER: 0.2}, 3, can_map=False) == [FOLDER] * 3
    assert loads(paths, {MAPPED: 0.1, FOLDER: 0.2}, 3, has_folder=False) == [MAPPED] * 3
