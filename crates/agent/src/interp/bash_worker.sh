# The bash side of a sandpit code context, fed to `bash --noprofile --norc --noediting -i`
# on its standard input. An interactive shell is used because only it abandons the running
# command line on SIGINT and goes back to reading input, keeping its variables and cwd.
# For each cell the agent writes four NUL-terminated fields to fd 3 (token, env prelude,
# code, env postlude) and the line below to stdin; the prompt hook reports the end of the
# cell, after writing the token to stdout and stderr, as a JSON line on fd 4.
set +m +H +o history
unset HISTFILE PROMPT_COMMAND
PS1='' PS2='' PS0='' PS4='+ '
__sp_tok=
__sp_post=
__sp_begin() {
  IFS= read -r -d '' -u 3 __sp_tok && IFS= read -r -d '' -u 3 __sp_pre &&
    IFS= read -r -d '' -u 3 __sp_code && IFS= read -r -d '' -u 3 __sp_post || return 1
  eval "$__sp_pre"
  printf '{"ev":"start"}\n' >&4
}
__sp_end() {
  local s=$?
  [ -n "$__sp_tok" ] || return 0
  eval "$__sp_post"
  printf '%s' "$__sp_tok"
  printf '%s' "$__sp_tok" >&2
  printf '{"ev":"done","token":"%s","status":%d}\n' "$__sp_tok" "$s" >&4
  __sp_tok=
}
PROMPT_COMMAND=__sp_end
printf '{"ev":"ready"}\n' >&4
