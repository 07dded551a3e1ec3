//! Lets every binary of this package (bins, tests, examples) find libtorch at run time without
//! LD_LIBRARY_PATH: torch-sys tells us where the libraries are (DEP_TCH_LIBTORCH_LIB, see its
//! `links = "tch"`), and we bake that folder into the binaries' rpath.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        // RUNPATH (new dtags) is searched after LD_LIBRARY_PATH, so a GPU machine can still point
        // the same binary at its own PyTorch libraries.
        println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{lib}");
    }
}
