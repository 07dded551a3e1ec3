//! Small measurement helpers the benchmarks share with the training loops: the median of a set
//! of timings, and this process's peak resident set size.

/// The median of `v` (sorts it; NaN when empty).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let k = v.len();
    if k == 0 {
        f64::NAN
    } else if k % 2 == 1 {
        v[k / 2]
    } else {
        (v[k / 2 - 1] + v[k / 2]) / 2.0
    }
}

/// This process's peak resident set size in bytes (`VmHWM` of /proc/self/status; Linux), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Start a new peak-RSS measurement: give freed heap memory back to the kernel (`malloc_trim`)
/// and reset the kernel's high-water mark (`echo 5 > /proc/self/clear_refs`), so that
/// [`peak_rss_bytes`] afterwards reports the peak of what follows (e.g. training steps, not model
/// construction). Linux only; elsewhere a no-op.
pub fn reset_peak_rss() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
