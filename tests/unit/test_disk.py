"""spanrl/core/disk.py: tree_bytes counts files below a folder, links by their own size."""
import os

from spanrl.core.disk import tree_bytes


def test_tree_bytes_counts_files_not_what_links_point_to(tmp_path):
    (tmp_path / "run" / "v1").mkdir(parents=True)
    (tmp_path / "run" / "v1" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "run" / "manifest.json").write_bytes(b"{}")
    big = tmp_path / "elsewhere.bin"
    big.write_bytes(b"y" * 5000)
    link = tmp_path / "run" / "latest"
    os.symlink(big, link)
    assert tree_bytes(tmp_path / "run") == 1000 + 2 + os.lstat(link).st_size
    assert tree_bytes(tmp_path / "run" / "manifest.json") == 2  # a file: its size
    assert tree_bytes(tmp_path / "gone") == 0
