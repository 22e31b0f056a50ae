//! A small ext4 file system on a loop device, for tests of full disks and power loss.
//! Needs root (mkfs.ext4, mount). Where that is missing a test skips and says so, unless
//! LINEAGE_REQUIRE_LOOP is set (`.ci/run` sets it), which makes it fail instead.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// An ext4 image mounted at `dir`; unmounted when dropped.
pub struct LoopDisk {
    pub image: PathBuf,
    pub dir: PathBuf,
}

impl LoopDisk {
    /// Makes and mounts a fresh `size_mb` image named `name` under `parent`. `-m 0`: no
    /// blocks reserved for root, so a full disk is full for the node (run as root) too.
    pub fn new(parent: &Path, name: &str, size_mb: u64) -> Result<LoopDisk, String> {
        let image = parent.join(format!("{name}.ext4"));
        let dir = parent.join(name);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(size_mb * 1024 * 1024))
            .map_err(|e| format!("image: {e}"))?;
        run("mkfs.ext4", &["-q", "-F", "-m", "0", path(&image)])?;
        let disk = LoopDisk { image, dir };
        disk.mount()?;
        Ok(disk)
    }

    fn mount(&self) -> Result<(), String> {
        run("mount", &["-o", "loop", path(&self.image), path(&self.dir)])
    }

    /// Power loss: the file system stops at once and drops everything not yet synced
    /// (EXT4_IOC_SHUTDOWN with EXT4_GOING_FLAGS_NOLOGFLUSH). Writes after this fail.
    pub fn power_off(&self) -> Result<(), String> {
        const SHUTDOWN: &str = "import fcntl, os, struct, sys\n\
            fd = os.open(sys.argv[1], os.O_RDONLY)\n\
            fcntl.ioctl(fd, 0x8004587d, struct.pack('I', 2))\n";
        run("python3", &["-c", SHUTDOWN, path(&self.dir)])
    }

    /// Power back on: unmount (processes on it must be gone) and mount again, which
    /// replays the journal; what was synced before `power_off` is there.
    pub fn power_on(&self) -> Result<(), String> {
        run("umount", &[path(&self.dir)]).or_else(|_| run("umount", &["-l", path(&self.dir)]))?;
        self.mount()
    }
}

impl Drop for LoopDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// One fresh `size_mb` image per node of a three-node cluster, named `node-1`..`node-3`
/// under `parent` (`None`: loop mounts cannot work here, and the test skips).
pub fn three_disks(parent: &Path, size_mb: u64) -> Option<Vec<LoopDisk>> {
    (1..=3)
        .map(|i| loop_disk_or_skip(parent, &format!("node-{i}"), size_mb))
        .collect()
}

pub fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// `LoopDisk::new`, or None (the test skips, and says so) where this machine cannot
/// mount one and LINEAGE_REQUIRE_LOOP is not set.
pub fn loop_disk_or_skip(parent: &Path, name: &str, size_mb: u64) -> Option<LoopDisk> {
    match LoopDisk::new(parent, name, size_mb) {
        Ok(disk) => Some(disk),
        Err(why) if std::env::var_os("LINEAGE_REQUIRE_LOOP").is_none() => {
            eprintln!("SKIPPED: cannot mount a loop ext4 image here ({why}); set LINEAGE_REQUIRE_LOOP=1 to fail instead");
            None
        }
        Err(why) => panic!("LINEAGE_REQUIRE_LOOP is set but no loop ext4 image: {why}"),
    }
}
