from offload.cli import command

command()
