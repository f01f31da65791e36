//! Progress bars for long work, shown only when stderr is a terminal.

/// A bar over `len` items named `unit`, labelled `label`; None when stderr is
/// not a terminal (scripts and CI then see only the summary line).
pub fn bar(len: u64, label: &str, unit: &str) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(len);
    let template = format!("{label} {{bar:30}} {{pos}}/{{len}} {unit} {{msg}} [{{elapsed_precise}}, eta {{eta}}]");
    if let Ok(style) = indicatif::ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    Some(bar)
}

/// A compaction's progress bar on a terminal, as [`trajlog::CompactOptions`]
/// takes it: the bar follows the sessions and shows the calls compacted. The
/// bar is cleared when the last session is done.
pub fn compact_progress(opts: trajlog::CompactOptions) -> trajlog::CompactOptions {
    let Some(bar) = bar(0, "compacting", "sessions") else {
        return opts;
    };
    opts.progress(move |done, total, calls| {
        bar.set_length(total);
        bar.set_position(done);
        bar.set_message(format!("{calls} calls"));
        if done >= total {
            bar.finish_and_clear();
        }
    })
}
