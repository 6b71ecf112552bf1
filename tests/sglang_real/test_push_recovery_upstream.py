"""The SGLang facts megamu's push recovery relies on (megamu/engines/sglang/push_recovery.py), pinned to the installed
SGLang 0.5.23 of the CPU build (read, not run: no server starts here). If a newer SGLang moves one, this fails and the
recovery is to be revisited.

- ``srt/model_executor/model_runner_components/weight_updater.py:193`` and ``:229-238``: ``update_weights_from_disk``
  points ``self.model_config.model_path`` at the new folder before loading, and on a load error its "Rolling back to
  original weights" reloads through that same config: the new folder again. A folder that cannot be read fails
  twice, the second time uncaught, and the scheduler dies (seen on the real server:
  test_real_push_recovery.py); a folder that loads but fails later rolls onto itself. So megamu checks its
  recovery export whole before any server is asked to load it (push_recovery._check_whole).
- ``srt/entrypoints/http_server.py:1300-1326``: ``/update_weights_from_disk`` answers a failure with HTTP 400
  (megamu: SGLangError, not retried as a control call; the recovery stops the run) and success with 200.
- ``http_server.py:1454``: ``/update_weights_from_tensor`` answers a failed push with HTTP 400 the same way.
- ``srt/managers/scheduler_components/weight_updater.py:349`` and ``:390``: a release adds each tag to
  ``offload_tags`` and a resume removes it (a set's ``remove``: KeyError for a tag not released), so megamu never
  sends a memory call again after a timeout (megamu/engines/sglang/pool.py REPEATABLE).
slime's side (THUDM/slime @624b824, read from the repository, not installed here): ``slime/utils/http_utils.py:165-190``
retries a control post on any error, 60 times 1 s apart; ``slime/ray/rollout.py:286-320`` restarts a dead engine from
the HF checkpoint and pushes the current weights into it before the next rollout (``recover_updatable_engines``,
:553-563); ``slime/backends/sglang_utils/sglang_engine.py:67-85`` waits for a starting server without a bound.
"""

from pathlib import Path

from tests.sglang_real.cpu_build import sglang_cpu_paths


def _sglang_file(relative: str) -> list[str]:
    venv, _ = sglang_cpu_paths()
    (site,) = venv.glob("lib/python3*/site-packages")
    return (Path(site) / "sglang" / relative).read_text().splitlines()


def test_a_failed_disk_update_rolls_back_to_the_folder_it_was_given():
    lines = _sglang_file("srt/model_executor/model_runner_components/weight_updater.py")
    assert lines[192].strip() == "self.model_config.model_path = model_path"  # line 193: before the load
    assert lines[228].strip() == "model = model_load_weights(self.get_model(), iter)"  # line 229
    assert "Rolling back to original weights." in lines[231]
    assert lines[235].strip() == "iter = get_weight_iter(self.model_config)"  # the new path again, as set at 193
    assert lines[236].strip() == "model_load_weights(self.get_model(), iter)"  # outside any try
    assert lines[237].strip() == "return False, message"


def test_failed_weight_updates_answer_http_400():
    lines = _sglang_file("srt/entrypoints/http_server.py")
    assert lines[1299].strip() == '@app.post("/update_weights_from_disk")'
    disk = "\n".join(lines[1301:1326])
    assert "if success:" in disk and "status_code=HTTPStatus.OK" in disk
    assert lines[1321].strip() == "else:" and lines[1324].strip() == "status_code=HTTPStatus.BAD_REQUEST,"
    assert "status_code=200 if success else HTTPStatus.BAD_REQUEST" in lines[1453]
    assert any('@app.post("/update_weights_from_tensor")' in ln for ln in lines[1430:1454])


def test_a_resume_sent_twice_would_raise_in_the_scheduler():
    lines = _sglang_file("srt/managers/scheduler_components/weight_updater.py")
    assert lines[336].strip().startswith("def release_memory_occupation(")  # line 337
    assert lines[348].strip() == "self.offload_tags.add(tag)"  # line 349
    assert lines[382].strip().startswith("def resume_memory_occupation(")  # line 383
    assert lines[389].strip() == "self.offload_tags.remove(tag)"  # line 390: KeyError for a tag resumed already
