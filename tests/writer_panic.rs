//! A panic in the writer thread (a bug) must fail loudly: every pending and
//! later call returns an error — none waits for ever — and every acknowledged
//! record is there after a reopen.

mod common;

use common::{assert_same, tempdir};
use std::sync::mpsc;
use std::time::Duration;
use trajlog::{Call, Durability, ErrorKind, Options, Store};

fn call(t: usize, n: usize) -> Call {
    Call {
        trace_id: format!("t{t}-{n}"),
        session_id: format!("s{t}"),
        timestamp: n as f64,
        prompt_token_ids: vec![n as u32; 64],
        completion_token_ids: vec![7; 16],
        logprobs: Some(vec![-0.5; 16]),
        ..Default::default()
    }
}

/// A safety net, not a verdict on speed: a call that never returns fails the
/// test after a minute instead of hanging the suite.
const NEVER: Duration = Duration::from_secs(60);

#[test]
fn a_writer_panic_fails_every_pending_and_later_call() {
    for durability in [Durability::Buffered, Durability::Group, Durability::Sync] {
        let dir = tempdir();
        // A queue of 1: appenders block in the channel while the writer dies.
        let store = std::sync::Arc::new(
            Store::open(dir.path(), Options::default().durability(durability).queue_depth(1)).expect("open"),
        );
        let mut acked = Vec::new();
        for n in 0..10 {
            let c = call(0, n);
            store.append_durable(c.clone()).expect("append before the panic");
            acked.push(c);
        }
        let (done_tx, done_rx) = mpsc::channel();
        let mut threads = Vec::new();
        for t in 1..5 {
            let (store, done) = (store.clone(), done_tx.clone());
            threads.push(std::thread::spawn(move || {
                let mut ok = Vec::new();
                let err = loop {
                    let c = call(t, ok.len());
                    match store.append_durable(c.clone()) {
                        Ok(()) => ok.push(c),
                        Err(e) => break e,
                    }
                };
                let _ = done.send((ok, err));
            }));
        }
        drop(done_tx);
        store.inject_writer_panic().expect("the hook is sent");
        for _ in 1..5 {
            let (ok, err) = done_rx.recv_timeout(NEVER).expect("an appender hung after the writer panicked");
            assert_eq!(err.kind(), &ErrorKind::Poisoned, "{durability:?}: {err}");
            assert!(err.message().contains("panicked"), "{err}");
            acked.extend(ok);
        }
        // Later calls fail at once, whatever they are.
        for result in [
            store.flush(),
            store.append(call(9, 0)).map(drop),
            store.seal_session("s0"),
            store.roll(),
            store.delete_session("s0").map(drop),
        ] {
            assert!(result.as_ref().is_err_and(|e| e.kind() == &ErrorKind::Poisoned), "{durability:?}: {result:?}");
        }
        for t in threads {
            t.join().expect("appender thread");
        }
        let store = std::sync::Arc::try_unwrap(store).ok().expect("sole owner");
        assert!(store.close().is_err(), "close reports the panic");
        let store = Store::open(dir.path(), Options::default()).expect("reopen");
        let snap = store.snapshot();
        for c in &acked {
            assert_same(&snap.get(&c.trace_id).expect("read").expect("acknowledged record lost"), c);
        }
    }
}
