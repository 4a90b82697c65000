"""Progress of long steps (torch_metal_flash.progress): a tqdm bar on stderr when it is a terminal
or TORCH_METAL_FLASH_PROGRESS=1, nothing otherwise; tune's reporter and the emulator's first-use
builds draw it."""
from torch_metal_flash.emulator import compiler
import torch_metal_flash.tune as cli


def test_tune_progress_is_quiet_off_a_terminal_and_drawn_when_asked(monkeypatch, capsys):
    monkeypatch.delenv("TORCH_METAL_FLASH_PROGRESS", raising=False)
    report = cli.progress_reporter()
    report(0, 2, "first")
    report(2, 2, "done")
    assert capsys.readouterr().err == ""  # pytest's stderr is not a terminal
    monkeypatch.setenv("TORCH_METAL_FLASH_PROGRESS", "1")
    report = cli.progress_reporter()
    report(0, 2, "first")
    report(2, 2, "done")
    err = capsys.readouterr().err
    assert "tuning" in err and "2/2" in err


def test_a_first_use_build_says_what_it_compiles(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TORCH_METAL_FLASH_PROGRESS", "1")
    target = tmp_path / "flash_fwd-fast-precise-0123.so"
    compiler._atomic_write(target, lambda tmp: open(tmp, "w").write("built"))
    assert target.read_text() == "built" and "compiling flash_fwd (first use, cached)" in capsys.readouterr().err
    compiler._atomic_write(target, lambda tmp: 1 / 0)  # cached: nothing built, nothing drawn
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TORCH_METAL_FLASH_PROGRESS", "0")
    compiler._atomic_write(tmp_path / "tmf_core-1.so", lambda tmp: open(tmp, "w").write("core"))
    assert capsys.readouterr().err == ""
