#compdef phi4

_phi4_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _PHI4_COMPLETE=complete_zsh phi4)
}

compdef _phi4_completion phi4
