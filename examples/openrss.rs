use std::time::Instant;
fn status(key: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or("")
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string()
}
fn main() {
    let dir = std::env::args().nth(1).unwrap();
    let writable = std::env::args().nth(2).is_some_and(|a| a == "w");
    let t = Instant::now();
    let store = if writable {
        trajlog::Store::open(&dir, trajlog::Options::default()).unwrap()
    } else {
        trajlog::Store::open_read_only(&dir).unwrap()
    };
    let el = t.elapsed();
    let snap = store.snapshot();
    let l = snap.index_layers();
    println!(
        "open {:.3} s writable={writable} calls={} frozen={} heap={} file={} RssAnon={} kB RssFile={} kB VmHWM={} kB",
        el.as_secs_f64(),
        l.calls,
        l.frozen_calls,
        l.frozen_bytes,
        l.index_file_bytes,
        status("RssAnon"),
        status("RssFile"),
        status("VmHWM")
    );
    // one session read
    let t = Instant::now();
    let s = snap.session("s000077", None, None).map(|v| v.len());
    println!("read one session {:?} in {:.3} ms", s, t.elapsed().as_secs_f64() * 1000.0);
}
