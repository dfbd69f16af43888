//! Running one cell: hand it to the worker, turn what comes back into NDJSON lines for the
//! client as it happens, and interrupt the cell when its timeout fires or the client goes
//! away.

use super::contexts::{Context, State};
use super::protocol::{Event, Language, OutLine, OutputSplitter, new_token};
use super::worker::{Msg, Stream};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedMutexGuard, mpsc};
use tokio::time::Instant;

/// A partial output line is sent after this long without a newline.
const PARTIAL_FLUSH: Duration = Duration::from_millis(50);
/// SIGINT is repeated this often until the cell stops (a blocking call may ignore one).
const INTERRUPT_REPEAT: Duration = Duration::from_millis(250);
/// A cell still running this long after the first interrupt has its worker killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(5);
/// After the worker exits, how long its output pipes may take to drain.
const EXIT_DRAIN: Duration = Duration::from_millis(250);

/// One `execute` request, validated.
pub struct Cell {
    pub code: String,
    pub env: BTreeMap<String, String>,
    pub timeout: Option<Duration>,
}

/// Why a cell was interrupted.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reason {
    Timeout(Duration),
    Disconnect,
}

/// Sends NDJSON lines to the client until it goes away.
struct Emitter {
    out: mpsc::Sender<Result<Bytes, Infallible>>,
    gone: bool,
}

impl Emitter {
    async fn emit(&mut self, line: OutLine) {
        if self.gone {
            return;
        }
        if self.out.send(Ok(Bytes::from(line.encode()))).await.is_err() {
            self.gone = true;
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs `cell` in `ctx` (whose lock is `guard`, with a live worker) and streams the
/// result lines into `out`; the lock is released when the cell is over.
pub async fn run(
    ctx: Arc<Context>,
    mut guard: OwnedMutexGuard<State>,
    cell: Cell,
    out: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let mut em = Emitter { out, gone: false };
    let state = &mut *guard;
    if state.worker.is_none() {
        em.emit(OutLine::Error {
            name: "WorkerExited".into(),
            value: "the context has no running worker".into(),
            traceback: String::new(),
        })
        .await;
        em.emit(OutLine::End).await;
        return;
    }
    state.count += 1;
    em.emit(OutLine::ExecutionCount(state.count)).await;
    let token = new_token();
    let (mut done, mut killed) = (false, false);
    let mut error: Option<OutLine> = None;
    let mut status = 0;
    let mut interrupt: Option<Reason> = None;
    let mut split = [OutputSplitter::new(&token), OutputSplitter::new(&token)];
    if let Some(worker) = state.worker.as_ref() {
        let killer = worker.killer();
        let (tx, mut rx) = mpsc::channel::<Msg>(64);
        worker.attach(tx);

        let (mut started, mut exited) = (false, false);
        let mut first_interrupt: Option<Instant> = None;
        let mut next_interrupt: Option<Instant> = None;
        let mut flush_at: Option<Instant> = None;
        let mut drain_until: Option<Instant> = None;
        let deadline = cell.timeout.map(|t| Instant::now() + t);
        let mut send = std::pin::pin!(worker.send_cell(&token, &cell.env, &cell.code));
        let mut sent = false;
        let out = em.out.clone();

        loop {
            if done && split.iter().all(OutputSplitter::done) {
                break;
            }
            if exited && split.iter().all(OutputSplitter::done) {
                break;
            }
            let mut want_interrupt = None;
            tokio::select! {
                biased;
                r = &mut send, if !sent => {
                    sent = true;
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "handing a cell to its worker");
                        // The worker is gone or wedged: only killing it ends this cell for sure.
                        killer.kill();
                    }
                }
                msg = rx.recv() => match msg {
                    Some(Msg::Out(stream, bytes)) => {
                        let s = &mut split[stream as usize];
                        if let Some(text) = s.push(&bytes) {
                            // An interactive bash echoes a newline when SIGINT aborts its line.
                            let echo = ctx.language == Language::Bash
                                && first_interrupt.is_some()
                                && stream == Stream::Stderr
                                && text == "\n";
                            if !echo {
                                em.emit(output(stream, text)).await;
                            }
                        }
                        flush_at = split
                            .iter()
                            .any(OutputSplitter::pending)
                            .then(|| Instant::now() + PARTIAL_FLUSH);
                    }
                    Some(Msg::OutEnd(stream)) => {
                        if let Some(text) = split[stream as usize].end() {
                            em.emit(output(stream, text)).await;
                        }
                    }
                    Some(Msg::Event(Event::Start)) => {
                        started = true;
                        if interrupt.is_some() {
                            killer.interrupt();
                            next_interrupt = Some(Instant::now() + INTERRUPT_REPEAT);
                        }
                    }
                    Some(Msg::Event(Event::Result { data })) => em.emit(OutLine::Result(data)).await,
                    Some(Msg::Event(Event::Error { name, value, traceback })) => {
                        error = Some(OutLine::Error { name, value, traceback });
                    }
                    Some(Msg::Event(Event::Done { token: t, status: s })) if t == token => {
                        done = true;
                        status = s;
                    }
                    Some(Msg::Event(_)) => {}
                    Some(Msg::Exited) => {
                        exited = true;
                        drain_until = Some(Instant::now() + EXIT_DRAIN);
                    }
                    // The worker's pumps hold the sender for as long as it is attached.
                    None => break,
                },
                _ = out.closed(), if interrupt.is_none() => want_interrupt = Some(Reason::Disconnect),
                _ = sleep_until_opt(deadline), if interrupt.is_none() => {
                    want_interrupt = cell.timeout.map(Reason::Timeout);
                }
                _ = sleep_until_opt(next_interrupt) => {
                    let since = first_interrupt.map(|t| t.elapsed()).unwrap_or_default();
                    if since >= INTERRUPT_GRACE {
                        tracing::info!(context = %ctx.id, "a cell ignored interrupts; killing its worker");
                        killed = true;
                        killer.kill();
                        next_interrupt = None;
                    } else {
                        if started {
                            killer.interrupt();
                        }
                        next_interrupt = Some(Instant::now() + INTERRUPT_REPEAT);
                    }
                }
                _ = sleep_until_opt(flush_at) => {
                    flush_at = None;
                    for stream in [Stream::Stdout, Stream::Stderr] {
                        if let Some(text) = split[stream as usize].flush() {
                            em.emit(output(stream, text)).await;
                        }
                    }
                }
                _ = sleep_until_opt(drain_until) => break,
            }
            if let Some(reason) = want_interrupt {
                interrupt = Some(reason);
                first_interrupt = Some(Instant::now());
                if started {
                    killer.interrupt();
                }
                next_interrupt = Some(Instant::now() + INTERRUPT_REPEAT);
            }
        }
        worker.detach();
        drop(rx);
    }
    for stream in [Stream::Stdout, Stream::Stderr] {
        if let Some(text) = split[stream as usize].end() {
            em.emit(output(stream, text)).await;
        }
    }
    let language = ctx.language;
    if done && error.is_none() && status != 0 && language == Language::Bash {
        error = Some(OutLine::Error {
            name: "ExitError".into(),
            value: format!("exit status {status}"),
            traceback: String::new(),
        });
    }
    if !done {
        let value = if killed {
            format!(
                "the cell did not stop within {} s of being interrupted, so its {} worker was \
                 killed; the context starts again with fresh state",
                INTERRUPT_GRACE.as_secs(),
                language.name()
            )
        } else {
            format!(
                "the {} worker exited during the cell; the context starts again with fresh state",
                language.name()
            )
        };
        error = Some(OutLine::Error {
            name: "WorkerExited".into(),
            value,
            traceback: String::new(),
        });
        // Dropping the worker kills whatever is left of it; the next cell starts anew.
        state.worker = None;
    }
    if let Some(Reason::Timeout(t)) = interrupt {
        let (traceback, lost) = match &error {
            Some(OutLine::Error {
                traceback, value, ..
            }) => (traceback.clone(), (!done).then(|| value.clone())),
            _ => (String::new(), None),
        };
        let mut value = format!(
            "execution exceeded its timeout of {} s and was interrupted",
            t.as_secs_f64()
        );
        if let Some(lost) = lost {
            value = format!("{value}; {lost}");
        }
        error = Some(OutLine::Error {
            name: "TimeoutError".into(),
            value,
            traceback,
        });
    }
    if let Some(e) = error {
        em.emit(e).await;
    }
    em.emit(OutLine::End).await;
}

fn output(stream: Stream, text: String) -> OutLine {
    match stream {
        Stream::Stdout => OutLine::Stdout(text),
        Stream::Stderr => OutLine::Stderr(text),
    }
}
