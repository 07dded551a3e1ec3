//! Lets every binary of this package (bins, tests, examples) find libtorch at run time without
//! LD_LIBRARY_PATH: torch-sys tells us where the libraries are (DEP_TCH_LIBTORCH_LIB, see its
//! `links = "tch"`), and we bake that folder into the binaries' rpath.
//!
//! The bins also link libtorch_cuda.so when the installed libtorch has it (the PyPI wheel does).
//! Nothing of ours calls into it, so the linker's --as-needed would drop it (tch-rs's "Not linked
//! to libtorch_cuda.so" problem) and the bins would see no GPU on a GPU machine: --no-as-needed
//! keeps it. Only the bins: loading the CUDA libraries costs about half a second and a few hundred
//! MB of mapped pages per process, and the test binaries start hundreds of rank processes that run
//! on the CPU.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        // RUNPATH (new dtags) is searched after LD_LIBRARY_PATH, so a GPU machine can still point
        // the same binary at its own PyTorch libraries.
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{lib}");
        let cuda = std::path::Path::new(&lib).join("libtorch_cuda.so");
        println!("cargo:rerun-if-changed={}", cuda.display());
        if cuda.is_file() {
            println!("cargo:rustc-link-arg-bins=-Wl,--no-as-needed,{},--as-needed", cuda.display());
        }
        // For the test that checks the above.
        println!("cargo:rustc-env=SHARDLAB_LIBTORCH_LIB={lib}");
    }
}
