//! The bins link libtorch_cuda.so when the installed libtorch has one (build.rs): without it the
//! linker's --as-needed drops the library (nothing calls into it by name), and a bin built here
//! would see no GPU on a GPU machine. Read from the built binary itself.

use std::path::Path;
use std::process::Command;

#[test]
fn bins_link_libtorch_cuda_when_libtorch_has_it() {
    let lib = Path::new(env!("SHARDLAB_LIBTORCH_LIB"));
    let has_cuda = lib.join("libtorch_cuda.so").is_file();
    for bin in [env!("CARGO_BIN_EXE_train"), env!("CARGO_BIN_EXE_lesson10")] {
        let out = Command::new("readelf").args(["-d", bin]).output().expect("readelf (binutils, as the linker) runs");
        assert!(out.status.success(), "readelf -d {bin}: {}", String::from_utf8_lossy(&out.stderr));
        let dynamic = String::from_utf8_lossy(&out.stdout);
        assert!(dynamic.contains("[libtorch_cpu.so]"), "{bin} does not need libtorch_cpu.so:\n{dynamic}");
        assert_eq!(
            dynamic.contains("[libtorch_cuda.so]"),
            has_cuda,
            "{bin}: libtorch_cuda.so {} among its NEEDED libraries, and {} has {}:\n{dynamic}",
            if dynamic.contains("[libtorch_cuda.so]") { "is" } else { "is not" },
            lib.display(),
            if has_cuda { "one" } else { "none (a CPU-only libtorch)" }
        );
    }
    if !has_cuda {
        eprintln!("note: the installed libtorch has no libtorch_cuda.so: checked that the bins do not ask for it");
    }
}
