//! A command's WebSocket: events in, stdin/signals/resizes out.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use futures::{SinkExt, StreamExt};
use sandpit_api::{ClientMessage, CommandEvent};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::ClientError;

/// The WebSocket a command stream runs on.
pub(crate) type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A live command on a WebSocket, from [`crate::Client::stream_command`] or [`crate::Client::attach`].
///
/// Read events with [`CommandStream::next_event`] until it returns `None` (the last event of
/// a finished command is [`CommandEvent::End`]); write with [`CommandStream::send`] and its
/// helpers. `next_event` is cancel-safe, so it can sit in a `tokio::select!` beside other
/// futures, and the stream can be used again from the select's handlers.
#[derive(Debug)]
pub struct CommandStream {
    ws: Ws,
    /// An `End` event was seen; what follows is only the connection closing.
    ended: bool,
    /// The connection is gone; further reads return `None`.
    closed: bool,
}

impl CommandStream {
    pub(crate) fn new(ws: Ws) -> Self {
        CommandStream {
            ws,
            ended: false,
            closed: false,
        }
    }

    /// Next event from the daemon, or `None` once the stream is closed.
    pub async fn next_event(&mut self) -> Result<Option<CommandEvent>, ClientError> {
        loop {
            if self.closed {
                return Ok(None);
            }
            let msg = match self.ws.next().await {
                None => {
                    self.closed = true;
                    return Ok(None);
                }
                Some(Ok(msg)) => msg,
                Some(Err(e)) => {
                    self.closed = true;
                    // Once the command has ended, a connection dropped without a close
                    // handshake loses nothing.
                    if self.ended || is_closed_error(&e) {
                        return Ok(None);
                    }
                    return Err(e.into());
                }
            };
            let event = match msg {
                Message::Text(text) => parse_event(text.as_bytes())?,
                Message::Binary(data) => parse_event(&data)?,
                Message::Close(_) => {
                    self.closed = true;
                    return Ok(None);
                }
                // Pings are answered by tungstenite itself.
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => continue,
            };
            if matches!(event, CommandEvent::End { .. }) {
                self.ended = true;
            }
            return Ok(Some(event));
        }
    }

    /// Sends a raw text message (the start request of a new command).
    pub(crate) async fn send_text(&mut self, text: String) -> Result<(), ClientError> {
        self.ws.send(Message::Text(text.into())).await?;
        Ok(())
    }

    /// Sends one control message (stdin bytes, close stdin, a signal, a resize).
    pub async fn send(&mut self, msg: ClientMessage) -> Result<(), ClientError> {
        let text = serde_json::to_string(&msg).map_err(|e| ClientError::Decode(e.to_string()))?;
        self.send_text(text).await
    }

    /// Writes raw bytes to the command's stdin (or its terminal).
    pub async fn write_stdin(&mut self, data: &[u8]) -> Result<(), ClientError> {
        self.send(ClientMessage::Stdin {
            data: B64.encode(data),
        })
        .await
    }

    /// Closes the command's stdin, so it sees end of file.
    pub async fn close_stdin(&mut self) -> Result<(), ClientError> {
        self.send(ClientMessage::CloseStdin).await
    }

    /// Sends `SIGTERM` or `SIGKILL` to the command.
    pub async fn signal(&mut self, signal: &str) -> Result<(), ClientError> {
        self.send(ClientMessage::Signal {
            signal: signal.to_string(),
        })
        .await
    }

    /// Changes the size of the command's pseudo-terminal.
    pub async fn resize(&mut self, cols: u16, rows: u16) -> Result<(), ClientError> {
        self.send(ClientMessage::Resize { cols, rows }).await
    }

    /// Closes the WebSocket politely; a running command goes on (reattach with
    /// [`crate::Client::attach`]).
    pub async fn close(mut self) -> Result<(), ClientError> {
        match self.ws.close(None).await {
            Ok(()) => Ok(()),
            Err(e) if is_closed_error(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads the stream to its end and returns decoded stdout (pty output included), stderr
    /// and the exit code. A stream that closes before `End` fails with the last `Error`
    /// event's message as [`ClientError::Command`] (e.g. the program could not be started),
    /// or with [`ClientError::Protocol`] if there was none. Stdin is left as it is: call
    /// [`CommandStream::close_stdin`] first for a command that reads it.
    pub async fn collect(mut self) -> Result<(Vec<u8>, Vec<u8>, i32), ClientError> {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let mut last_error = None;
        while let Some(event) = self.next_event().await? {
            match event {
                CommandEvent::Start { .. } => {}
                CommandEvent::Stdout { data } | CommandEvent::Pty { data } => {
                    stdout.extend(decode_data(&data)?);
                }
                CommandEvent::Stderr { data } => stderr.extend(decode_data(&data)?),
                CommandEvent::End { exit_code, .. } => return Ok((stdout, stderr, exit_code)),
                CommandEvent::Error { message } => last_error = Some(message),
            }
        }
        Err(match last_error {
            Some(message) => ClientError::Command(message),
            None => ClientError::Protocol("the stream closed before the command ended".into()),
        })
    }
}

/// Decodes the base64 `data` of an output event.
pub fn decode_data(data: &str) -> Result<Vec<u8>, ClientError> {
    B64.decode(data)
        .map_err(|e| ClientError::Decode(format!("bad base64 in command output: {e}")))
}

fn parse_event(raw: &[u8]) -> Result<CommandEvent, ClientError> {
    serde_json::from_slice(raw).map_err(|e| ClientError::Decode(format!("bad command event: {e}")))
}

fn is_closed_error(e: &tungstenite::Error) -> bool {
    matches!(
        e,
        tungstenite::Error::ConnectionClosed
            | tungstenite::Error::AlreadyClosed
            | tungstenite::Error::Protocol(
                tungstenite::error::ProtocolError::ResetWithoutClosingHandshake
            )
    )
}
