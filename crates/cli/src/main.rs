//! The `trajlog` command-line tool; see `trajlog --help`.
//!
//! Standard output that is a closed pipe (`trajlog ls | head`) ends the
//! process quietly with exit code 0, as ripgrep does. Rust ignores SIGPIPE,
//! so a write to a pipe without a reader is an `EPIPE` error, on which std's
//! `println!` panics. Every subcommand prints through the [`println!`] below,
//! which shadows std's in the whole `cli` tree, or, where it keeps its own
//! locked writer (`ingest`, `export`), checks [`is_broken_pipe`] itself and
//! stops cleanly. Any other failure to write stdout (a full disk behind
//! `> file`) is reported with exit code 2, never ignored.
//!
//! Why not reset SIGPIPE to its default action: that needs `unsafe` FFI (no
//! `libc` dependency, and `unsafe` lives in `storage/` only), and the signal
//! exit (status 141) fails `set -o pipefail` pipelines for a reader that
//! simply had enough. Exiting from `println!` skips destructors like the
//! signal would; a store open at that moment is left as after a crash, which
//! recovery handles (every acknowledged record is durable).

/// std's `println!` without the panic: through [`print_stdout`].
macro_rules! println {
    () => {
        $crate::print_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::print_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod bench_engine;
mod bench_gateway;
mod cli;
mod progress;

fn main() {
    std::process::exit(cli::main());
}

/// Write to stdout; on a closed pipe exit 0 at once (nobody reads what is
/// left), on any other error exit 2 naming it.
pub(crate) fn print_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        std::process::exit(stdout_failed(&e));
    }
}

/// Whether a write failed because stdout's reader went away (`| head`).
pub(crate) fn is_broken_pipe(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::BrokenPipe
}

/// The exit code after a failed write to stdout: 0 for a closed pipe (the
/// reader has what it wanted), otherwise 2, with the error on stderr.
pub(crate) fn stdout_failed(e: &std::io::Error) -> i32 {
    if is_broken_pipe(e) {
        return 0;
    }
    eprintln!("trajlog: error: cannot write to standard output: {e}");
    2
}
