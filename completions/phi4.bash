_phi4_completion() {
    local IFS=$'
'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   _PHI4_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _phi4_completion phi4
